"""Independent reference implementations the tests hold the package to (the package never imports them)."""
