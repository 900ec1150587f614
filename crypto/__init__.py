"""Privacy core: CKKS aggregation, key provisioning, clipping, noise, accounting."""
