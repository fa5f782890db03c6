"""A user's own training code, as csrun imports it from a config (run csrun from
examples/, so that ``toypkg`` is importable from the current folder)."""
