"""``tmas view``: a local, read-only web viewer of run directories (Starlette, server-rendered Jinja2 pages).

Needs the ``serve`` extra (starlette, uvicorn); the charts need the ``eval`` extra (matplotlib).
"""
