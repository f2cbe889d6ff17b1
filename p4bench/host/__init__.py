"""The plugin host: the pluggy manager and the per-kind registries (`manager`), loading of the
`p4bench` entry points and of plugin commands (`loading`), and the types they share (`types`)."""
