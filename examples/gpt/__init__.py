"""A tiny GPT trained with hybrid parallelism (data x tensor x pipeline) under fleet."""
