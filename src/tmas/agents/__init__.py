"""Agents: prompt templates (Jinja2 files in ``prompts/``) and typed parsers of their outputs."""
