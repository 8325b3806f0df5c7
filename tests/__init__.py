"""raylazy's tests, laid out like the package: core/, storage/, io/, cluster/, integrations/; support/ holds what they share."""
