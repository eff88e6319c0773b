"""Backends: one package per chip family. Importing one registers its providers on the HAL ops and exposes
BACKEND, its priority list per op. Backends contain no model knowledge."""
