"""The search: an optuna study over the space, the tuner that proposes, screens and tells, the
solver's per-block plans, and predicted answers in place of probes (`tune --predict`)."""
