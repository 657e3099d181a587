package idempotencyv1_test

import (
	"testing"
	"time"

	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/durationpb"

	idempotencyv1 "github.com/exactlyonce/idempotency/proto/idempotency/v1"
)

// methodExtensionNumber is the number documented in idempotency.proto.
// Changing it breaks every descriptor compiled against the old one.
const methodExtensionNumber protoreflect.FieldNumber = 51973

func TestMethodExtension(t *testing.T) {
	xd := idempotencyv1.E_Method.TypeDescriptor()
	if got := xd.Number(); got != methodExtensionNumber {
		t.Errorf("E_Method number = %d, want %d", got, methodExtensionNumber)
	}
	if got, want := xd.FullName(), protoreflect.FullName("idempotency.v1.method"); got != want {
		t.Errorf("E_Method full name = %s, want %s", got, want)
	}
	if got, want := xd.ContainingMessage().FullName(), protoreflect.FullName("google.protobuf.MethodOptions"); got != want {
		t.Errorf("E_Method extends %s, want %s", got, want)
	}
	if got, want := xd.Message().FullName(), protoreflect.FullName("idempotency.v1.MethodPolicy"); got != want {
		t.Errorf("E_Method value type = %s, want %s", got, want)
	}

	xt, err := protoregistry.GlobalTypes.FindExtensionByNumber("google.protobuf.MethodOptions", methodExtensionNumber)
	if err != nil {
		t.Fatalf("extension %d of google.protobuf.MethodOptions not registered: %v", methodExtensionNumber, err)
	}
	if xt != idempotencyv1.E_Method {
		t.Errorf("registered extension %d is %v, not E_Method", methodExtensionNumber, xt.TypeDescriptor().FullName())
	}
}

func TestMethodPolicyRegistered(t *testing.T) {
	mt, err := protoregistry.GlobalTypes.FindMessageByName("idempotency.v1.MethodPolicy")
	if err != nil {
		t.Fatalf("idempotency.v1.MethodPolicy not registered: %v", err)
	}
	if _, ok := mt.New().Interface().(*idempotencyv1.MethodPolicy); !ok {
		t.Errorf("registered type is %T, want *idempotencyv1.MethodPolicy", mt.New().Interface())
	}
	if _, err := protoregistry.GlobalFiles.FindFileByPath("idempotency/v1/idempotency.proto"); err != nil {
		t.Errorf("file not registered under its import path: %v", err)
	}
}

// TestOptionRoundTrip checks the option survives encoding of MethodOptions,
// as it does when embedded in a service's generated descriptor.
func TestOptionRoundTrip(t *testing.T) {
	want := &idempotencyv1.MethodPolicy{
		Mode:     idempotencyv1.MethodPolicy_MODE_REQUIRED,
		Ttl:      durationpb.New(time.Hour),
		KeyField: "meta.request_id",
	}
	opts := &descriptorpb.MethodOptions{}
	proto.SetExtension(opts, idempotencyv1.E_Method, want)

	b, err := proto.Marshal(opts)
	if err != nil {
		t.Fatal(err)
	}
	got := &descriptorpb.MethodOptions{}
	if err := proto.Unmarshal(b, got); err != nil {
		t.Fatal(err)
	}
	if !proto.HasExtension(got, idempotencyv1.E_Method) {
		t.Fatal("option lost in round trip")
	}
	if p := proto.GetExtension(got, idempotencyv1.E_Method).(*idempotencyv1.MethodPolicy); !proto.Equal(p, want) {
		t.Errorf("round trip = %v, want %v", p, want)
	}
}
