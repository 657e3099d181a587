package idempotency

import (
	"strings"
	"sync"

	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
)

// methodPolicy is what the proto descriptors say about one method.
type methodPolicy struct {
	// known is false when the method's descriptor is not in the global
	// registry (no generated code linked in, or a hand-written ServiceDesc).
	known bool
	// safe is true for methods marked idempotency_level NO_SIDE_EFFECTS or
	// IDEMPOTENT: repeating them is harmless, so they need no key.
	safe bool
}

// policies caches methodPolicy by full method name ("/pkg.Service/Method"),
// so the descriptor lookup happens once per method, not once per call.
var policies sync.Map

func policyFor(fullMethod string) methodPolicy {
	if p, ok := policies.Load(fullMethod); ok {
		return p.(methodPolicy)
	}
	p := resolvePolicy(fullMethod)
	policies.Store(fullMethod, p)
	return p
}

func resolvePolicy(fullMethod string) methodPolicy {
	md := methodDescriptor(fullMethod)
	if md == nil {
		return methodPolicy{}
	}
	p := methodPolicy{known: true}
	if opts, ok := md.Options().(*descriptorpb.MethodOptions); ok {
		switch opts.GetIdempotencyLevel() {
		case descriptorpb.MethodOptions_NO_SIDE_EFFECTS, descriptorpb.MethodOptions_IDEMPOTENT:
			p.safe = true
		}
	}
	return p
}

// methodDescriptor finds "/pkg.Service/Method" in the global registry of
// generated descriptors, or returns nil.
func methodDescriptor(fullMethod string) protoreflect.MethodDescriptor {
	svc, method, ok := strings.Cut(strings.TrimPrefix(fullMethod, "/"), "/")
	if !ok {
		return nil
	}
	d, err := protoregistry.GlobalFiles.FindDescriptorByName(protoreflect.FullName(svc))
	if err != nil {
		return nil
	}
	sd, ok := d.(protoreflect.ServiceDescriptor)
	if !ok {
		return nil
	}
	return sd.Methods().ByName(protoreflect.Name(method))
}
