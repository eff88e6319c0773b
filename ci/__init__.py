"""The per-vendor CI matrix (matrix.yaml): run one vendor column, or generate the GitHub workflow from it."""
