"""Sandbox: isolated execution of model-written code, as a NATS request/reply service.
Not built yet: see the README's roadmap."""
