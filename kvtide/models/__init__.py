"""Model implementations (plain nn.Modules), the architecture registry and the weight loader."""
