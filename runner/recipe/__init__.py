"""The recipe: a YAML file or a library name in, a validated Recipe out, every problem at its line."""
