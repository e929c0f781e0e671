//! Loading a namespace's policies: from manifests (`-f`) or from a cluster, reached like
//! kubectl does (`--kubeconfig`, else `KUBECONFIG`, else `~/.kube/config`, else in-cluster;
//! `--context`; the context's namespace unless `-n`).

use std::path::PathBuf;

use anyhow::{Context as _, Result, anyhow, bail};
use clap::Args;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::{
    Api, Client, Config,
    api::ListParams,
    config::{KubeConfigOptions, Kubeconfig},
};
use rebound_policy::{
    RetryPolicy,
    compiled::{CONFIGMAP_KEY, CompiledDocument},
};

use crate::{
    Findings,
    args::Inputs,
    input::{self, Parsed},
};

/// The cluster flags, accepted by every command (kubectl passes them through to plugins).
#[derive(Args, Clone, Debug, Default)]
pub struct ClusterArgs {
    /// Kubeconfig file (default: $KUBECONFIG, then ~/.kube/config, then in-cluster).
    #[arg(long, global = true, value_name = "FILE")]
    pub kubeconfig: Option<PathBuf>,
    /// Kubeconfig context to use.
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// Name of the compiled ConfigMap (the operator's --configmap-name).
    #[arg(
        long,
        global = true,
        default_value = "rebound-policies",
        value_name = "NAME"
    )]
    pub configmap: String,
}

/// Policies of one namespace and, from a cluster, its compiled ConfigMap.
pub struct Namespace {
    pub namespace: String,
    pub policies: Vec<RetryPolicy>,
    /// `Some` only when read from a cluster: `None` inside means no ConfigMap yet.
    pub configmap: Option<Option<CompiledDocument>>,
}

/// The valid RetryPolicies of the files; an invalid one is a finding (figures for something
/// the cluster rejects would mislead) and an unreadable file an error.
pub fn from_files(inputs: &Inputs, default_namespace: &str) -> Result<Vec<RetryPolicy>> {
    let mut out = Vec::new();
    for source in input::sources(inputs)? {
        let (name, parsed) = source.parse();
        match parsed {
            Parsed::Unreadable(e) => return Err(e),
            Parsed::NotYaml(e) => {
                return Err(Findings(format!("{name}: not valid YAML: {e}")).into());
            }
            Parsed::Documents(docs) => {
                for doc in docs {
                    match doc.result {
                        Ok((mut object, _)) => {
                            if object.metadata.namespace.is_none() {
                                object.metadata.namespace = Some(default_namespace.to_owned());
                            }
                            out.push(object);
                        }
                        Err(errors) => {
                            return Err(Findings(format!(
                                "{name}:{}:{}: {} (run `rebound validate` for every problem)",
                                doc.index, errors[0].field, errors[0].message
                            ))
                            .into());
                        }
                    }
                }
            }
        }
    }
    Ok(out)
}

/// Runs a cluster operation on a small runtime of its own (offline commands need none).
pub fn block_on<T>(f: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?
        .block_on(f)
}

/// A client and the namespace to use.
pub async fn connect(args: &ClusterArgs, namespace: Option<String>) -> Result<(Client, String)> {
    let options = KubeConfigOptions {
        context: args.context.clone(),
        ..Default::default()
    };
    let config = match &args.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .with_context(|| format!("cannot read kubeconfig {}", path.display()))?;
            Config::from_custom_kubeconfig(kubeconfig, &options).await?
        }
        None if args.context.is_some() => Config::from_kubeconfig(&options).await?,
        None => Config::infer().await?,
    };
    let namespace = namespace.unwrap_or_else(|| config.default_namespace.clone());
    let client = Client::try_from(config).context("cannot build a Kubernetes client")?;
    Ok((client, namespace))
}

pub async fn list_policies(client: &Client, namespace: &str) -> Result<Vec<RetryPolicy>> {
    let api: Api<RetryPolicy> = Api::namespaced(client.clone(), namespace);
    Ok(api
        .list(&ListParams::default())
        .await
        .with_context(|| format!("cannot list RetryPolicies in namespace {namespace:?}"))?
        .items)
}

/// The compiled document of the namespace's ConfigMap, checked by the sidecar's parser;
/// `None` if there is no such ConfigMap.
pub async fn compiled_document(
    client: &Client,
    namespace: &str,
    name: &str,
) -> Result<Option<CompiledDocument>> {
    let api: Api<ConfigMap> = Api::namespaced(client.clone(), namespace);
    let Some(cm) = api
        .get_opt(name)
        .await
        .with_context(|| format!("cannot read ConfigMap {namespace}/{name}"))?
    else {
        return Ok(None);
    };
    // As text in `data`, or gzip'd in `binaryData` (a document past 900 KiB).
    let json = match cm.data.as_ref().and_then(|d| d.get(CONFIGMAP_KEY)) {
        Some(text) => text.clone().into_bytes(),
        None => {
            let gz = cm
                .binary_data
                .as_ref()
                .and_then(|d| d.get(CONFIGMAP_KEY))
                .ok_or_else(|| {
                    anyhow!("ConfigMap {namespace}/{name} has no key {CONFIGMAP_KEY}")
                })?;
            let limit = rebound_policy::compiled::MAX_INFLATED_DOCUMENT_BYTES as u64;
            let mut json = Vec::new();
            std::io::Read::read_to_end(
                &mut std::io::Read::take(flate2::read::GzDecoder::new(&gz.0[..]), limit + 1),
                &mut json,
            )
            .with_context(|| format!("ConfigMap {namespace}/{name}: not a valid gzip document"))?;
            if json.len() as u64 > limit {
                bail!("ConfigMap {namespace}/{name}: the document inflates past {limit} bytes");
            }
            json
        }
    };
    let doc = CompiledDocument::from_json(&json)
        .with_context(|| format!("ConfigMap {namespace}/{name}"))?;
    Ok(Some(doc))
}

/// The namespace's policies from the files, or from the cluster (with its ConfigMap).
pub fn namespace(
    args: &ClusterArgs,
    inputs: &Inputs,
    namespace: Option<String>,
) -> Result<Namespace> {
    if !inputs.files.is_empty() {
        let default_ns = namespace.clone().unwrap_or_else(|| "default".to_owned());
        let policies = from_files(inputs, &default_ns)?;
        // As in the cluster, one namespace: the given one, else the first manifest's.
        let namespace = namespace.unwrap_or_else(|| {
            policies
                .first()
                .and_then(|p| p.metadata.namespace.clone())
                .unwrap_or(default_ns)
        });
        return Ok(Namespace {
            namespace,
            policies,
            configmap: None,
        });
    }
    block_on(async {
        let (client, namespace) = connect(args, namespace).await?;
        let policies = list_policies(&client, &namespace).await?;
        let doc = compiled_document(&client, &namespace, &args.configmap).await?;
        Ok(Namespace {
            namespace,
            policies,
            configmap: Some(doc),
        })
    })
}
