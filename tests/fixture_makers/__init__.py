"""The makers of tests/make_fixtures.py, one fixture family a module. They need torch and
transformers, so they run in the Python 3.11 venv that script names, never under pytest."""
