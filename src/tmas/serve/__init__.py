"""``tmas serve``: an OpenAI-compatible proxy that answers each chat completion with a test-time scaling method.

Needs the ``serve`` extra (starlette, uvicorn).
"""
