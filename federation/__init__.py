"""Federation glue: Flower ServerApp and ClientApp around ``node``."""
