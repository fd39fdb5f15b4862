// Command kubevirt-check runs KubeVirt's own virt-launcher host-device builders (from the
// released kubevirt.io/kubevirt module, unmodified) on what a VM pod's container sees, and prints
// the libvirt <hostdev> elements KubeVirt would put into the domain, or KubeVirt's exact error.
//
// Usage:
//
//	kubevirt-check --vmi VMI.yaml [--env FILE] [--root DIR]
//
//	--vmi VMI.yaml  a VirtualMachineInstance (YAML or JSON). Outside spec, field names are
//	                case-sensitive and unknown or duplicate fields are refused; spec goes through
//	                KubeVirt's own VirtualMachineInstanceSpec.UnmarshalJSON (encoding/json), as in
//	                virt-launcher: there names match case-insensitively and unknown fields are ignored.
//	--env FILE      the container's environment as /proc/<pid>/environ has it: KEY=VALUE entries
//	                separated by NUL bytes (or, if the file has none, by newlines). The process's
//	                environment is cleared and set to exactly these before KubeVirt's code runs;
//	                without --env it is left empty.
//	--root DIR      a directory standing in for virt-launcher's container root: the DRA metadata
//	                files are read under DIR + the linked version's dra.DefaultMetadataBasePath
//	                (default: the real root).
//
// The calls are those LibvirtDomainManager.generateConverterContext
// (pkg/virt-launcher/virtwrap/manager.go) makes, in the linked version's order (calls_v1_9.go;
// calls_v1_8.go, selected by the build tag kubevirt_v1_8, where the GPU call comes second):
//
//	generic.CreateHostDevices(vmi.Spec.Domain.Devices.HostDevices)  env PCI_RESOURCE_*, MDEV_PCI_RESOURCE_*, USB_RESOURCE_*
//	dra.CreateDRAHostDevices(vmi, basePath)                         DRA metadata files under basePath
//	gpu.CreateHostDevices(vmi.Spec.Domain.Devices.GPUs)             env
//	dra.CreateDRAGPUHostDevices(vmi, basePath)                      DRA metadata files
//
// Output: stdout's first line is "kubevirt <version>", the kubevirt.io/kubevirt module version
// linked into the binary. Then, if every call succeeds, each <hostdev> (KubeVirt's
// api.HostDevice marshalled with encoding/xml), one per line, in the order built, and the exit
// status is 0. If a call fails: "error: <KubeVirt's error text>" on stderr, exit status 1.
// Usage errors and unreadable inputs: a message on stderr, exit status 2. KubeVirt's own log
// lines go to stderr.
//
// Build (the libvirt Go binding KubeVirt imports is cgo only; libvirt_dlopen needs a C compiler
// but no libvirt): see build.sh.
package main

import (
	"bytes"
	"encoding/xml"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"runtime/debug"
	"strings"

	v1 "kubevirt.io/api/core/v1"
	drautil "kubevirt.io/kubevirt/pkg/dra"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const kubevirtModule = "kubevirt.io/kubevirt"

// usageError is an error in the command line or its input files (exit status 2).
type usageError struct{ error }

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	fs := flag.NewFlagSet("kubevirt-check", flag.ContinueOnError)
	fs.SetOutput(stderr)
	vmiPath := fs.String("vmi", "", "a VirtualMachineInstance `YAML` file (required)")
	envPath := fs.String("env", "", "the container's environment `FILE` (NUL- or newline-separated KEY=VALUE)")
	root := fs.String("root", "", "a `DIR` standing in for virt-launcher's container root")
	fs.Usage = func() {
		fmt.Fprintln(stderr, "usage: kubevirt-check --vmi VMI.yaml [--env FILE] [--root DIR]")
		fs.PrintDefaults()
	}
	if err := fs.Parse(args); err != nil {
		return 2
	}
	if *vmiPath == "" || fs.NArg() != 0 {
		fs.Usage()
		return 2
	}

	version, err := linkedVersion()
	if err != nil {
		fmt.Fprintf(stderr, "kubevirt-check: %v\n", err)
		return 2
	}
	fmt.Fprintf(stdout, "kubevirt %s\n", version)

	hostDevices, err := check(*vmiPath, *envPath, *root)
	var uerr usageError
	if errors.As(err, &uerr) {
		fmt.Fprintf(stderr, "kubevirt-check: %v\n", uerr.error)
		return 2
	}
	if err != nil {
		fmt.Fprintf(stderr, "error: %v\n", err)
		return 1
	}
	for _, hd := range hostDevices {
		out, err := xml.Marshal(hd)
		if err != nil {
			fmt.Fprintf(stderr, "kubevirt-check: marshalling a hostdev: %v\n", err)
			return 1
		}
		fmt.Fprintf(stdout, "%s\n", out)
	}
	return 0
}

// check reads the inputs, sets the environment and runs KubeVirt's builders. Input problems are
// usageErrors; any other error is KubeVirt's, unchanged.
func check(vmiPath, envPath, root string) ([]api.HostDevice, error) {
	vmi, err := readVMI(vmiPath)
	if err != nil {
		return nil, usageError{err}
	}
	var env []string
	if envPath != "" {
		if env, err = readEnv(envPath); err != nil {
			return nil, usageError{err}
		}
	}
	os.Clearenv()
	for _, kv := range env {
		k, v, _ := strings.Cut(kv, "=")
		if err := os.Setenv(k, v); err != nil {
			return nil, usageError{fmt.Errorf("%s: setting %q: %v", envPath, k, err)}
		}
	}
	basePath := drautil.DefaultMetadataBasePath
	if root != "" {
		basePath = filepath.Join(root, drautil.DefaultMetadataBasePath)
	}
	return buildHostDevices(vmi, basePath)
}

func readVMI(path string) (*v1.VirtualMachineInstance, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	data, err = yaml.YAMLToJSON(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	// Case-sensitive, unknown and duplicate fields refused; but the spec is decoded by KubeVirt's
	// own VirtualMachineInstanceSpec.UnmarshalJSON (encoding/json), which is lenient in both.
	vmi := &v1.VirtualMachineInstance{}
	strict, err := kjson.UnmarshalStrict(data, vmi)
	if err != nil {
		return nil, fmt.Errorf("%s: %v", path, err)
	}
	if len(strict) > 0 {
		return nil, fmt.Errorf("%s: %v", path, errors.Join(strict...))
	}
	if vmi.Kind != "" && vmi.Kind != "VirtualMachineInstance" {
		return nil, fmt.Errorf("%s: kind %q, not VirtualMachineInstance", path, vmi.Kind)
	}
	return vmi, nil
}

// readEnv reads KEY=VALUE entries separated by NUL bytes, or by newlines if there is none.
func readEnv(path string) ([]string, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	sep := []byte{0}
	if !bytes.Contains(data, sep) {
		sep = []byte{'\n'}
	}
	var env []string
	for _, entry := range bytes.Split(data, sep) {
		if len(entry) == 0 {
			continue
		}
		if i := bytes.IndexByte(entry, '='); i <= 0 {
			return nil, fmt.Errorf("%s: not KEY=VALUE: %q", path, entry)
		}
		env = append(env, string(entry))
	}
	return env, nil
}

// linkedVersion is the kubevirt.io/kubevirt version linked into the binary; it must be one
// whose call order this build has.
func linkedVersion() (string, error) {
	info, ok := debug.ReadBuildInfo()
	if !ok {
		return "", errors.New("no build information in the binary")
	}
	for _, dep := range info.Deps {
		if dep.Path != kubevirtModule {
			continue
		}
		version := dep.Version
		if dep.Replace != nil {
			version = dep.Replace.Version
		}
		if !strings.HasPrefix(version, callOrderOf) {
			return "", fmt.Errorf("built with KubeVirt %s's call order but linked with %s %s (build.sh has each version's tags)",
				strings.TrimSuffix(callOrderOf, "."), kubevirtModule, version)
		}
		return version, nil
	}
	return "", fmt.Errorf("%s is not linked into the binary", kubevirtModule)
}

func concat(lists ...[]api.HostDevice) []api.HostDevice {
	var all []api.HostDevice
	for _, l := range lists {
		all = append(all, l...)
	}
	return all
}
