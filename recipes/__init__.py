"""Built-in YAML recipes for ``sparse-train`` (installed as the package ``sparse_train.recipes``)."""
