//! The metrics exporter on the simulated NIC (being written).
