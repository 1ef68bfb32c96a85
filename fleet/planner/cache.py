"""The planner's cache (being written)."""
