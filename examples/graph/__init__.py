"""Graph-table examples: GraphSAGE and DeepWalk on a generated stochastic block model."""
