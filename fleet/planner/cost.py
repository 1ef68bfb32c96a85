"""The planner's cost (being written)."""
