"""Who a request acts for, what it may ask, and what it costs: auth, tenants, quotas,
metering."""
