"""The REST API (``fleetwave serve --listen``): FastAPI served by uvicorn, beside the
engine in one process or alone (``--no-engine``). See docs/api.md.

FastAPI is imported only by what serves the API, never when ``fleetwave`` starts.
"""
