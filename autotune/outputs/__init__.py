"""What a search leaves: report.json and the Pareto table, tuned.yaml, and the training with the
winner (falling back down the ranking; as N ranks under --nproc)."""
