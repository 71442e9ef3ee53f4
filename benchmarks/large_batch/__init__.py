"""LAMB and LARS against AdaScale at equal examples, on the scaling study's SGD tasks."""
