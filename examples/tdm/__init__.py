"""TDM example: a tree index over generated items (:mod:`fleet.data.tree_index`), layer-wise
sampled training of a (user, tree node) scorer and beam-search retrieval (:mod:`.train_tdm`)."""
