"""The roles' words, not the roles: for each agent role a method calls (solution, verifier, summary, experience,
guideline, MATTRL's specialists, judges, ...) its prompt (a Jinja2 file in ``prompts/``, rendered by a builder
here) and the typed parser of its reply. The roles themselves (who is called when, with which inputs) are the
methods in :mod:`tmas.methods`; the name ``agents`` is kept because users' ``prompts_dir`` overrides, docs and the
project's history name the templates' folder ``agents/prompts``."""
