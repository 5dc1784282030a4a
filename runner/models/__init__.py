"""Small models shipped with ckrun, reachable from a recipe as `ckrun.runner.models.MODULE:FACTORY`."""
