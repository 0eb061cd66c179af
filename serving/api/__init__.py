"""The Serve replica: a `Deployment` spec in, a Ray Serve application out, answering OpenAI-compatible HTTP.

    builder.py   build_app(spec) / app_builder(args): the Serve application (what `serve run` and a RayService import)
    server.py    PylonLLMServer: the deployment class; one engine (or a pool) per replica, metrics, admission
    http.py      OpenAIApp: the ASGI app the replica answers HTTP with (auth, routes, SSE, OpenAI error bodies)
    protocol.py  the request and response models of the OpenAI API

Deploying and deleting from a client is the SDK's (`pylon.sdk.serve`).
"""
