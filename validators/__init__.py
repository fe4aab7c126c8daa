"""Runtime validation of fxmem: run models for real, measure peak memory, compare.

Run from a checkout: ``python -m validators`` (not installed: PyPI already has a popular
package named ``validators``).
"""
