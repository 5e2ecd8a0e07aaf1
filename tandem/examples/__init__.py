"""Built-in example models and data (scikit-learn's bundled digits: no downloads)."""
