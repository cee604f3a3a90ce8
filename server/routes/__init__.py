"""HTTP routes, one module per resource: files, batches, models (+ health)."""
