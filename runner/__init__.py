"""ckrun's runner: recipes, building, the memory plan, measuring memory and the training loop."""
