"""guess_number: an OpenEnv environment (models, server) for the OpenEnv bridge's tests."""
