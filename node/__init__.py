"""The cache node: model, data, local training, applying aggregates."""
