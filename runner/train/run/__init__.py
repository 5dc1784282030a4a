"""A run's life around the loop: owning output.dir, what it says at the start and while it trains,
what can end it early (guard), and the memory cap it runs under."""
