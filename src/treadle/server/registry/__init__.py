"""Model package groups: names, bindings, versions and reading them back."""
