"""The ``flywheel`` command's groups, one module each: each adds its commands to the parser
(``add``) and holds their handlers; :mod:`flywheel.ops.cli` puts them together."""
