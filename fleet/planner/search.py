"""The planner's search (being written)."""
