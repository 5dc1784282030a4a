"""Measuring a candidate: the probe child in a fresh process (or a group of ranks), the model child
that holds the user's model for facts and predictions, and the warm server that forks both."""
