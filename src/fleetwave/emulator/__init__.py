"""The site emulator: N virtual remote sites on one HTTP port, each with a software
update API that behaves as a StarlingX subcloud's orchestrator does.

``settings`` reads what a site is told (its settings, presets, the config file);
``site`` owns a site's state and decides how it moves with time (pure: the time is
given); ``app`` is the HTTP API over them (FastAPI); ``fleetwave site-emulator``
(``fleetwave.cli.site_emulator``) serves it. The API is in docs/site-emulator.md.
"""
