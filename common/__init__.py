"""IO-doing pieces both servers share: libpq server loop, config, logging, metrics, HTTP glue."""
