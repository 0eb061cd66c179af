"""pylon.serving: the continuous-batching engine, Ray Serve deployments and the OpenAI-compatible API."""
