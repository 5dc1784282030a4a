"""The plan's types: memory policies, distributed strategies, and the MemoryPlan made of them."""
