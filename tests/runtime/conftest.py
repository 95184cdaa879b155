"""Redis fixtures now live in tests/conftest.py for every test folder."""
