"""ckrun's tuner: searches memory plans under a byte cap by measuring them. Stands on runner."""
