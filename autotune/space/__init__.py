"""The search space: the device's and the model's facts, one candidate plan, the knob table (`KNOBS`)
and each knob's entry (pools, sharding), and why a candidate cannot run."""
