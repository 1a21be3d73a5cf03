//! Prints the CRD YAML generated from the types; `crds/peregrine-crds.yaml` and the chart's copy are
//! this output (`cargo run -p peregrine-crds --bin crdgen > crds/peregrine-crds.yaml`).

fn main() -> Result<(), serde_yaml::Error> {
    print!("{}", peregrine_crds::crd_yaml()?);
    Ok(())
}
