"""Small models shipped with ckrun, reachable from a recipe as `runner.models.MODULE:FACTORY`."""
