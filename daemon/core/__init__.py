"""The foundation: config, errors, paths, atomic writes, episodes, templates,
the state database. Imports no other layer."""
