//go:build !kubevirt_v1_8

package main

import (
	v1 "kubevirt.io/api/core/v1"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/api"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/dra"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/generic"
	"kubevirt.io/kubevirt/pkg/virt-launcher/virtwrap/device/hostdevice/gpu"
)

// callOrderOf is the KubeVirt minor version whose call order buildHostDevices follows.
const callOrderOf = "v1.9."

// buildHostDevices makes the host-device calls of KubeVirt 1.9's
// LibvirtDomainManager.generateConverterContext (and its getGPUDevices), in its order:
// generic device-plugin hostDevices, DRA hostDevices, device-plugin GPUs, DRA GPUs.
func buildHostDevices(vmi *v1.VirtualMachineInstance, basePath string) ([]api.HostDevice, error) {
	genericHostDevices, err := generic.CreateHostDevices(vmi.Spec.Domain.Devices.HostDevices)
	if err != nil {
		return nil, err
	}
	genericDRAHostDevices, err := dra.CreateDRAHostDevices(vmi, basePath)
	if err != nil {
		return nil, err
	}
	gpuHostDevices, err := gpu.CreateHostDevices(vmi.Spec.Domain.Devices.GPUs)
	if err != nil {
		return nil, err
	}
	gpuDRAHostDevices, err := dra.CreateDRAGPUHostDevices(vmi, basePath)
	if err != nil {
		return nil, err
	}
	return concat(genericHostDevices, genericDRAHostDevices, gpuHostDevices, gpuDRAHostDevices), nil
}
