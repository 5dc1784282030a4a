"""ckrun's runner: recipes, building, the memory plan, measuring memory, the training loop and predicting memory."""
