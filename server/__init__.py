"""The extension's REST surface and metrics beside SGLang's server."""
